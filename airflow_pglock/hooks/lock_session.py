"""The lock SQL: one dedicated lock session and the statements it runs, and :class:`HeldLock`.

Every statement that takes, checks or gives back an advisory lock is here, as a function
of the lock's own connection (``try_lock``, ``wait_lock``, ``unlock``, ``is_held``,
``commit``, the heartbeat's ``probe``). :class:`HeldLock` is one lock held on its own
session: it owns its check, its release and, in transaction scope, its commit. Opening
the connection and checking the server is the hook's job (``advisory_lock.py``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from psycopg import sql

from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.hooks import server as server_rules
from airflow_pglock.hooks import wakeups
from airflow_pglock.hooks.server import Scope, ServerInfo
from airflow_pglock.keys import LockKey, slot_keys

if TYPE_CHECKING:
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook

log = logging.getLogger("airflow_pglock")

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
_IN_TRANSACTION = "txid_current_if_assigned() IS NOT DISTINCT FROM {0}::bigint"
IN_LOCK_TRANSACTION = " AND " + _IN_TRANSACTION
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


def _call(function: str, key: LockKey) -> sql.Composed:
    return _CALLS[(function, key.is_pair)]


def _compose(function: str, pair: bool) -> sql.Composed:
    casts = [sql.SQL("%s::integer")] * 2 if pair else [sql.SQL("%s::bigint")]
    return sql.SQL("SELECT {}({})").format(sql.Identifier(function), sql.SQL(", ").join(casts))


# Composed once: a lock session takes and releases keys in a tight loop.
_CALLS = {
    (f"{base}{suffix}", pair): _compose(f"{base}{suffix}", pair)
    for base in (
        "pg_try_advisory_lock",
        "pg_try_advisory_xact_lock",
        "pg_advisory_lock",
        "pg_advisory_xact_lock",
        "pg_advisory_unlock",
    )
    for suffix in ("", "_shared")
    for pair in (False, True)
}


def _function(base: str, shared: bool) -> str:
    return f"{base}_shared" if shared else base


def _named_call(function: str, key: LockKey) -> tuple[sql.Composed, dict[str, Any]]:
    """``function(<key>)`` with named parameters ``k1`` (and ``k2`` for a pair)."""
    if key.is_pair:
        call = sql.SQL("{}(%(k1)s::integer, %(k2)s::integer)").format(sql.Identifier(function))
        return call, {"k1": key.numbers[0], "k2": key.numbers[-1]}
    return sql.SQL("{}(%(k1)s::bigint)").format(sql.Identifier(function)), {"k1": key.int64}


# The first statement of a lock session tries the lock only where a lock excludes: on a
# primary, and (for a session lock, unless a session pooler is declared) on the very session
# that answered the handshake, whose pid came in its key data. It answers what the rules of
# hooks/server.py need besides the handshake, so no statement of its own inspects the server.
_FIRST_TRY = (
    "SELECT CASE WHEN NOT pg_is_in_recovery() AND (pg_backend_pid() = %(reported_pid)s OR %(pooled)s)"
    " THEN {attempt} END, pg_backend_pid(), pg_is_in_recovery(), pg_postmaster_start_time(){registry}{xact}"
)
# A transaction lock's session opens its transaction (READ COMMITTED whatever the database's
# or role's default: under REPEATABLE READ or SERIALIZABLE the snapshot would be taken before
# the lock is granted, and the work and the once_per check would read what was there before
# the previous holder committed) and sets its liveness in the same simple query as the first
# try, which then also answers the transaction's id: one round trip, as a session lock's try.
_OPEN_TRANSACTION = "BEGIN ISOLATION LEVEL READ COMMITTED; {liveness}; "


@dataclass(frozen=True)
class FirstTry:
    """What the first statement of a lock session answered.

    :param taken: True / the slot's index when a lock was taken; None when not (busy,
        or refused by the statement's condition: ``server`` tells which).
    :param server: the handshake's facts completed by the session's answers.
    :param registry: whether the key-name registry's schema is there (:data:`schema.REGISTRY_STATE`), or None
        when not asked (a key without a name).
    :param xact_id: transaction scope: the id of the transaction the statement opened.
    """

    taken: int | bool | None
    server: ServerInfo
    registry: str | None
    xact_id: int | None = None


def first_try(
    conn: psycopg.Connection[Any],
    handshake: ServerInfo,
    pool: list[LockKey],
    *,
    shared: bool,
    scope: Scope,
    pool_mode: str | None,
    opening: sql.Composable | None = None,
) -> FirstTry:
    """Try the lock (one key, or the first free slot of ``pool``) in the session's first statement.

    :param opening: transaction scope: the statements that open the lock's transaction
        (:data:`_OPEN_TRANSACTION`), sent in the same simple query, before the try.
    """
    base = "pg_try_advisory_lock" if scope == "session" else "pg_try_advisory_xact_lock"
    params: dict[str, Any] = {
        "reported_pid": handshake.reported_pid,
        "pooled": server_rules.safe_behind_pooler(scope, pool_mode),
    }
    if len(pool) > 1:
        attempt: sql.Composable = sql.SQL("({})").format(_first_free(base))
        params["slots"] = [key.int64 for key in pool]
    else:
        attempt, key_params = _named_call(_function(base, shared), pool[0])
        params.update(key_params)
    from airflow_pglock.hooks import schema  # schema -> ledger -> this module

    asks_registry = pool[0].name is not None
    registry = sql.SQL(", ") + schema.REGISTRY_STATE if asks_registry else sql.SQL("")
    # A standby cannot assign a transaction id; the rules refuse it from the row's answers.
    xact = sql.SQL("")
    if opening is not None:
        xact = sql.SQL(", CASE WHEN NOT pg_is_in_recovery() THEN txid_current() END")
    statement = sql.SQL(_FIRST_TRY).format(attempt=attempt, registry=registry, xact=xact)
    if opening is None:
        row = conn.execute(statement, params).fetchone()
    else:
        # Several statements in one simple query take no parameters: psycopg binds them client-side.
        inlined = psycopg.ClientCursor(conn).mogrify(statement, params)
        cursor = conn.execute(sql.Composed([opening, sql.SQL(inlined)]))
        while cursor.nextset():  # the try's row is the last result
            pass
        row = cursor.fetchone()
    assert row is not None
    server = dataclasses.replace(handshake, backend_pid=row[1], in_recovery=row[2], started_at=row[3])
    return FirstTry(
        taken=row[0],
        server=server,
        registry=row[4] if asks_registry else None,
        xact_id=None if opening is None or row[-1] is None else int(row[-1]),
    )


def try_lock(conn: psycopg.Connection[Any], key: LockKey, *, shared: bool = False, scope: Scope = "session") -> bool:
    """One ``pg_try_advisory[_xact]_lock[_shared]`` on ``conn``; True if taken."""
    base = "pg_try_advisory_lock" if scope == "session" else "pg_try_advisory_xact_lock"
    row = conn.execute(_call(_function(base, shared), key), key.numbers).fetchone()
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

    Returns False when the wait timed out; a timed-out wait holds nothing.
    """
    check_wait_timeout(timeout)
    base = "pg_advisory_lock" if scope == "session" else "pg_advisory_xact_lock"
    statement = _call(_function(base, shared), key)
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


def _first_free(function: str) -> sql.Composed:
    # Slot 1 is tried in the anchor; slot n + 1 only in the row the recursion makes from a
    # refused slot n (the WHERE filters the working table's one row before the target list
    # is computed). After a success the recursion has no row left to try from, so at most
    # one try returns true: one slot per statement, whatever the plan.
    return sql.SQL(
        "WITH RECURSIVE attempt(n, taken) AS ("
        " SELECT 1, {f}((%(slots)s::bigint[])[1])"
        " UNION ALL"
        " SELECT n + 1, {f}((%(slots)s::bigint[])[n + 1]) FROM attempt"
        " WHERE NOT taken AND n < cardinality(%(slots)s::bigint[])"
        ") SELECT n FROM attempt WHERE taken"
    ).format(f=sql.Identifier(function))


def try_slot(conn: psycopg.Connection[Any], slots: list[LockKey], *, scope: Scope = "session") -> int | None:
    """Take the first free of ``slots`` (int64 keys, exclusive) in one statement, trying them in order.

    Returns the index of the slot taken, or None when every slot is held. Never takes more
    than one (see :func:`_first_free`; ``tests/integration/test_slots.py`` races it).
    """
    base = "pg_try_advisory_lock" if scope == "session" else "pg_try_advisory_xact_lock"
    row = conn.execute(_first_free(base), {"slots": [key.int64 for key in slots]}).fetchone()
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


def _each_key(function: str) -> sql.Composed:
    """``function`` applied to every key of three parallel arrays (int64s; or the two halves
    of a pair), in the order given: one statement, one round trip."""
    call = sql.SQL(
        "SELECT CASE WHEN k.whole IS NOT NULL THEN {f}(k.whole) ELSE {f}(k.first, k.second) END"
        " FROM unnest(%s::bigint[], %s::integer[], %s::integer[]) WITH ORDINALITY AS k(whole, first, second, n)"
        " ORDER BY k.n"
    )
    return call.format(f=sql.Identifier(function))


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


def try_lock_many(conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False) -> list[bool]:
    """``pg_try_advisory_lock[_shared]`` for each key, in one round trip per
    :data:`MANY_KEYS_PER_STATEMENT` keys; whether each was taken, in order."""
    return _for_each_key(conn, _function("pg_try_advisory_lock", shared), keys)


def unlock_many(conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False) -> list[bool]:
    """``pg_advisory_unlock[_shared]`` for each key (as :func:`try_lock_many`); whether each was held.

    Not announced to waiting triggers: they see these keys free at their next poll.
    """
    return _for_each_key(conn, _function("pg_advisory_unlock", shared), keys)


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


@dataclass(frozen=True)
class WriteAtRelease:
    """A write that travels with the lock's release, in its round trip (the key-name registry's
    record of the key's name: ``registry.record_acquisition``).

    :param statement: the write, its values bound (psycopg's client-side binding); it returns rows.
    :param done: called with the write's rows once it ran with the release.
    :param failed: called instead, with the error, when the write failed there: its query's
        transaction is rolled back and the connection usable (it may write again on its own);
        a session lock's unlock has run, a transaction lock's commit follows.
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
        condition, params = _IN_TRANSACTION.format("%s"), [xact_id]
    else:
        condition, params = HELD_CONDITION.format("pg_backend_pid()", "%s", "%s", "%s", "%s"), held_params(key, shared)
    # Several statements in one simple query take no parameters: psycopg binds them client-side.
    statements = [psycopg.ClientCursor(conn).mogrify(_CHECK.format(condition=condition), params)]
    if at_release is not None:
        statements += [_SAVEPOINT, at_release.statement, f"RELEASE {_SAVEPOINT}"]
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
        at_release.done(rows[2])
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


def unlock(
    conn: psycopg.Connection[Any], key: LockKey, *, shared: bool = False, at_release: WriteAtRelease | None = None
) -> bool:
    """``pg_advisory_unlock[_shared]``: True if this session held the key.

    The same statement announces the release to waiting triggers (``pg_notify``, see
    :mod:`~airflow_pglock.hooks.wakeups`): no extra round trip.

    :param at_release: a write sent in the same round trip, right after the unlock: the key is
        free as soon as without it. A write that fails there rolls back the query's implicit
        transaction, and with it the announcement (waiting triggers then see the key free at
        their next poll); the unlock stands (a session lock's unlock is not transactional).
    """
    statement = sql.SQL("{}, pg_notify({}, %s)").format(
        _call(_function("pg_advisory_unlock", shared), key), sql.Literal(wakeups.RELEASED_CHANNEL)
    )
    params = [*key.numbers, wakeups.payload(key)]
    if at_release is None:
        row = conn.execute(statement, params).fetchone()
        return bool(row and row[0])
    bound = psycopg.ClientCursor(conn).mogrify(statement, params)
    results = _results_of(conn, f"{bound}; {at_release.statement}")
    encoding = conn.info.encoding
    unlocked = results[0]
    if unlocked.status != psycopg.pq.ExecStatus.TUPLES_OK:
        raise psycopg.errors.error_from_result(unlocked, encoding=encoding)
    written = results[1] if len(results) > 1 else None
    if written is not None and written.status == psycopg.pq.ExecStatus.TUPLES_OK:
        at_release.done([(bytes(written.get_value(row, 0) or b"").decode(encoding),) for row in range(written.ntuples)])
    elif written is not None:
        at_release.failed(conn, psycopg.errors.error_from_result(written, encoding=encoding))
    else:
        at_release.failed(conn, psycopg.OperationalError("the session ended before the write at release ran"))
    return unlocked.ntuples > 0 and unlocked.get_value(0, 0) == b"t"


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


def is_held(conn: psycopg.Connection[Any], key: LockKey, shared: bool = False, xact_id: int | None = None) -> bool:
    """Whether this very session holds the key now (reads ``pg_locks``, takes nothing).

    :param xact_id: for a transaction lock, the transaction that took it: also check
        that the session is still in that transaction.
    """
    params = held_params(key, shared) + ([] if xact_id is None else [xact_id])
    statement = held_sql("pg_backend_pid()", ("%s", "%s", "%s", "%s"), None if xact_id is None else "%s")
    row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
    return bool(row and row[0])


def probe(
    conn: psycopg.Connection[Any],
    key: LockKey | None,
    shared: bool,
    timeout: float,
    *,
    xact_id: int | None = None,
    before_giving_up: Callable[[], None] | None = None,
) -> ProbeResult:
    """The heartbeat: does this session still hold ``key``? Never blocks much longer than ``timeout``.

    Unlike :func:`is_held`, it cannot hang on a dead network or a frozen server: when no
    answer has arrived after ``timeout`` seconds, it closes the connection (so the server
    drops the session as soon as it hears from it again) and returns ``"no answer"``.
    When the protected work is using the connection for that long (transaction mode),
    it returns ``"busy"``: a session running a statement is not idle, so the server keeps
    its lock; also while the work has a pipeline open on it (a query sent now would be
    queued behind the work's). A session that ended raises the server's error
    (``AdminShutdown``, ``IdleSessionTimeout``...) or ``OperationalError`` when the
    connection broke.

    :param conn: the lock's own connection.
    :param key: the key it should hold; None: only whether the session is alive (a lock
        session: its locks can only end with it or by its own unlock), ``"held"`` if so.
    :param shared: whether it holds the key in shared mode.
    :param timeout: seconds to wait for the connection and the answer together.
    :param xact_id: transaction scope: the lock's transaction (see :func:`is_held`).
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
        if key is None:
            statement, params = "SELECT true", []
        else:
            params = [str(value) for value in held_params(key, shared)]
            if xact_id is not None:
                params.append(str(xact_id))
            statement = held_sql("pg_backend_pid()", ("$1", "$2", "$3", "$4"), None if xact_id is None else "$5")
        pgconn.send_query_params(statement.encode(), [value.encode() for value in params])
        results = results_before(pgconn, deadline)
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


def results_before(pgconn: psycopg.pq.abc.PGconn, deadline: float) -> list[psycopg.pq.abc.PGresult] | None:
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


@dataclass
class HeldLock:
    """A lock held on its own dedicated connection. Release it (or let a context manager).

    :param key: the key held.
    :param shared: whether the lock is shared (readers) rather than exclusive.
    :param scope: ``"session"`` or ``"transaction"``.
    :param connection: the dedicated connection; in transaction scope, do your database
        work on it: it runs inside the transaction that holds the lock.
    :param server: what the connection found at the other end.
    :param hook: the hook that took the lock (its side connections, e.g. for fencing).
    :param acquired_at: when the lock was taken (UTC).
    :param acquired_monotonic: ``time.monotonic()`` at acquisition, for durations.
    :param released: True once :meth:`release` ran.
    :param xact_id: transaction scope: the id (``txid_current()``) of the transaction that
        holds the lock; every later check verifies the session is still in it.
    :param registry: the key-name registry's state when the lock was taken (for a key
        with a name: ``schema.REGISTRY_ABSENT`` or ``REGISTRY_PRESENT``), else None.
    :param at_release: a write to send with the release (the unlock, or the commit), once.
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
    xact_id: int | None = None
    registry: str | None = None
    at_release: WriteAtRelease | None = None

    def is_held(self) -> bool:
        """Ask the server whether this session still holds the key (a round trip).

        False once the session has ended (the lease ran out while the connection sat idle,
        the session was terminated, the connection broke): the server released the lock
        with it. The reason is logged as a warning; the error never reaches the caller.
        """
        if self.connection.closed:
            return False
        try:
            return is_held(self.connection, self.key, self.shared, self.xact_id)
        except psycopg.OperationalError as error:  # AdminShutdown, IdleSessionTimeout, a broken connection...
            log.warning(
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
                was_held = unlock(self.connection, self.key, shared=self.shared, at_release=self._take_at_release())
            elif self.scope == "transaction" and not self.connection.closed:
                was_held = is_held(self.connection, self.key, self.shared, self.xact_id)
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
        if status != psycopg.pq.TransactionStatus.INTRANS:  # aborted: COMMIT says so (and commits nothing)
            commit(self.connection)
            return True
        if not record():
            return False
        return commit_if_held(self.connection, self.key, self.shared, self.xact_id, self._take_at_release())

    def commit(self) -> None:
        """Transaction scope: commit the lock's transaction (which releases the lock).

        Raises ``NoActiveSqlTransaction`` when the work ended the lock's transaction (whatever
        ran afterwards ran without the lock) and ``InFailedSqlTransaction`` when an error had
        aborted it: nothing is committed then.
        """
        in_transaction = self.connection.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        if not in_transaction:
            commit(self.connection)
        elif not commit_if_held(self.connection, self.key, self.shared, self.xact_id, self._take_at_release()):
            raise psycopg.errors.NoActiveSqlTransaction(
                "the lock's transaction was ended on its connection (a COMMIT or ROLLBACK by the work): the lock "
                "ended with it, and whatever ran afterwards ran without the lock; not committed"
            )

    def probe(self, timeout: float, before_giving_up: Callable[[], None] | None = None) -> ProbeResult:
        """The heartbeat's bounded check of this lock (see :func:`probe`)."""
        return probe(
            self.connection, self.key, self.shared, timeout, xact_id=self.xact_id, before_giving_up=before_giving_up
        )

    def unlock_checked(self) -> bool:
        """Session scope: unlock (the connection stays open); whether the key was still held."""
        return unlock(self.connection, self.key, shared=self.shared, at_release=self._take_at_release())

    def _take_at_release(self) -> WriteAtRelease | None:
        at_release, self.at_release = self.at_release, None  # sent once, with the first release statement
        return at_release

    def close(self) -> None:
        """Close the connection: the session ends, an open transaction rolls back, the lock goes
        with them. Idempotent; no check (see :meth:`release` for that)."""
        self.released = True
        self.connection.close()


def held_seen_from_aside(conn: psycopg.Connection[Any], held: HeldLock) -> bool:
    """Whether ``held``'s session still holds its key (in its transaction), asked on another
    session ``conn``: for when the lock's own connection is busy with the work."""
    pid = held.server.backend_pid
    statement = "SELECT " + HELD_CONDITION.format("%s", "%s", "%s", "%s", "%s")
    params: list[Any] = [pid, *held_params(held.key, held.shared)]
    if held.xact_id is not None:
        statement += _SIDE_IN_LOCK_TRANSACTION.format("%s", "%s")
        params += [pid, held.xact_id]
    row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
    return bool(row and row[0])


def take(
    hook: AdvisoryLockHook,
    conn: psycopg.Connection[Any],
    handshake: ServerInfo,
    key: LockKey,
    *,
    shared: bool,
    scope: Scope,
    timeout: float | None,
    slots: int = 1,
    pool_mode: str | None = None,
) -> HeldLock | None:
    """Take ``key`` on a freshly opened lock session; None when busy (the caller closes ``conn``).

    The first statement tries the lock where it is safe and completes the server's facts
    (:func:`first_try`); the rules of ``hooks/server.py`` then judge them and raise
    :class:`~airflow_pglock.exceptions.UnsafeSetupError` for a set-up where a lock would
    exclude nobody (no lock was taken then). A wait (``timeout``) follows a refused try.

    :param handshake: what the handshake said (:func:`server.from_handshake`).
    :param scope: ``"session"`` (autocommit; held until released) or ``"transaction"``
        (a transaction is opened and stays open; the lock ends with it).
    :param timeout: None to try once, or seconds to wait (enforced by the server; a pool is polled).
    :param slots: more than one: ``key`` names a pool (:func:`~airflow_pglock.keys.slot_keys`);
        the lock held is the first free slot.
    :param pool_mode: the connection's declared ``pool_mode``.
    """
    pool = slot_keys(key, slots)
    opening = None
    if scope == "transaction":
        liveness = hook.liveness_statement(local=True, server_version_num=handshake.version_num)
        opening = sql.SQL(_OPEN_TRANSACTION).format(liveness=liveness)
    answer = first_try(conn, handshake, pool, shared=shared, scope=scope, pool_mode=pool_mode, opening=opening)
    server = answer.server
    found = server_rules.violations(server, scope, pool_mode)
    if found:
        if answer.taken and scope == "session":  # the statement's condition and the rules disagree
            unlock(conn, pool[int(answer.taken) - 1] if slots > 1 else key, shared=shared)
        raise found[0].error()
    if server.behind_pooler:
        # Through PgBouncer, a server-side prepared statement may outlive the transaction on a
        # server session another client gets next: never prepare on a lock connection.
        conn.prepare_threshold = None
    if slots > 1:
        slot = None if answer.taken is None else int(answer.taken) - 1
        if slot is None and timeout is not None:
            slot = wait_slot(conn, pool, timeout, scope=scope)
        if slot is None:
            return None
        key = pool[slot]
    elif not answer.taken and (timeout is None or not wait_lock(conn, key, timeout, shared=shared, scope=scope)):
        return None
    return HeldLock(
        key=key,
        shared=shared,
        scope=scope,
        connection=conn,
        server=server,
        hook=hook,
        xact_id=answer.xact_id,
        registry=answer.registry,
    )
