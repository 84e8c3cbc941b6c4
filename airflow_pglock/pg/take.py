"""Taking a lock: a lock session's first statement, and a wait after a busy try.

The first statement of a lock session tries the lock only where a lock excludes, opens a
transaction lock's transaction with it, and answers what the server rules need besides the
handshake (:func:`first_try`); :func:`take` judges the answers, waits if asked, and returns
the :class:`~airflow_pglock.pg.held.HeldLock`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock import server_rules
from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.keys import MAX_SLOTS, LockKey, is_named_key
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.key_names import REGISTRY_STATE, SCOPES_IDLE, SCOPES_LIVE
from airflow_pglock.pg.pools import (
    MARKER_BUSY,
    PLAIN_CHECK,
    POOL_CHECK,
    pool_conflict_error,
    pool_in_use,
    pool_markers,
    pool_params,
)
from airflow_pglock.pg.release import give_back_all, unlock
from airflow_pglock.pg.sql import (
    catalog_function,
    inline,
    key_params,
    liveness_statement,
    lock_function,
    named_call_text,
)
from airflow_pglock.pg.statements import first_free, wait_lock, wait_slot
from airflow_pglock.server_rules import Scope, ServerInfo

# The first statement of a lock session tries the lock only where a lock excludes: on a
# primary, and (for a session lock, unless a session pooler is declared) on the very session
# that answered the handshake, whose pid came in its key data. It answers what the rules of
# server_rules.py need besides the handshake, so no statement of its own inspects the server.
# The server's start time is not asked: a loss is told from a restart by the server's uptime
# (loss.refine_with_server_start).
_WHERE_A_LOCK_EXCLUDES = (
    "NOT pg_catalog.pg_is_in_recovery() AND (pg_catalog.pg_backend_pid() = %(reported_pid)s OR %(pooled)s)"
)
_FIRST_TRY = (
    "SELECT CASE WHEN "
    + _WHERE_A_LOCK_EXCLUDES
    + " THEN {attempt} END, pg_catalog.pg_backend_pid(), pg_catalog.pg_is_in_recovery()"
    "{registry}{conflict}{xact}{source}"
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
    :param registry: whether the key-name registry's schema is there
        (:data:`~airflow_pglock.pg.key_names.REGISTRY_STATE`), or None when not asked (a key without a name).
    :param xact_id: transaction scope: the id of the transaction the statement opened.
    :param conflict: a pool, or a plain key of a pool's name, refused by the statement
        (:data:`~airflow_pglock.pg.pools.POOL_CHECK`): ``(kind, the other size, the other holder's
        pid)``; nothing taken.
    """

    taken: int | bool | None
    server: ServerInfo
    registry: str | None
    xact_id: int | None = None
    conflict: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class _Shape:
    """What the text of a first statement depends on (its values are parameters)."""

    function: str
    pair: bool
    checks_pool: bool
    slots: bool
    scope: Scope
    asks_registry: bool
    opens_transaction: bool


# Each shape's text, rendered once per process: psycopg caches the conversion of a text query,
# and would render a composed one anew for every lock (docs/benchmarks.md, section 1).
_FIRST_TRY_TEXTS: dict[_Shape, str] = {}


def _first_try_statement(shape: _Shape) -> sql.Composed:
    conflict: sql.Composable = sql.SQL("")
    source: sql.Composable = sql.SQL("")
    if shape.slots:
        # The check runs in a subquery of the FROM, so before the target list that tries a slot.
        slot_try = first_free(shape.function)
        attempt: sql.Composable = sql.SQL("CASE WHEN pool.conflict IS NULL THEN ({}) END").format(slot_try)
        marker_try = catalog_function(lock_function("try", shared=True, scope=shape.scope))
        check = sql.SQL(POOL_CHECK).format(shared_try=marker_try, max_slots=sql.Literal(MAX_SLOTS))
        conflict = sql.SQL(", pool.conflict")
        source = sql.SQL(" FROM (SELECT CASE WHEN {} THEN {} END AS conflict OFFSET 0) AS pool").format(
            sql.SQL(_WHERE_A_LOCK_EXCLUDES), check
        )
    else:
        attempt = named_call_text(shape.function, shape.pair)
        if shape.checks_pool:
            attempt = sql.SQL(PLAIN_CHECK).format(attempt=attempt)
    registry = sql.SQL(", ") + REGISTRY_STATE if shape.asks_registry else sql.SQL("")
    # A standby cannot assign a transaction id; the rules refuse it from the row's answers.
    xact = sql.SQL("")
    if shape.opens_transaction:
        xact = sql.SQL(", CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN pg_catalog.txid_current() END")
    return sql.SQL(_FIRST_TRY).format(attempt=attempt, registry=registry, conflict=conflict, xact=xact, source=source)


def first_try(
    conn: psycopg.Connection[Any],
    handshake: ServerInfo,
    pool: list[LockKey],
    *,
    shared: bool,
    scope: Scope,
    pool_mode: str | None,
    opening: sql.Composable | None = None,
    candidates: Sequence[int] | None = None,
) -> FirstTry:
    """Try the lock (one key, or the first free slot of ``pool``) in the session's first statement.

    :param opening: transaction scope: the statements that open the lock's transaction
        (:data:`_OPEN_TRANSACTION`), sent in the same simple query, before the try.
    :param candidates: a pool: the indexes of the slots to try, in order (default: all). The
        pool's size checks are those of the whole pool whatever is tried.
    """
    params: dict[str, Any] = {
        "reported_pid": handshake.reported_pid,
        "pooled": server_rules.safe_behind_pooler(scope, pool_mode),
    }
    checks_pool = is_named_key(pool[0])
    if checks_pool:
        params.update(pool_params(pool[0], len(pool)))
    if len(pool) > 1:
        tried = list(range(len(pool))) if candidates is None else list(candidates)
        params["slots"] = [pool[index].int64 for index in tried]
    else:
        params.update(key_params(pool[0]))
    asks_registry = pool[0].name is not None
    shape = _Shape(
        function=lock_function("try", shared=shared and len(pool) == 1, scope=scope),
        pair=pool[0].is_pair,
        checks_pool=checks_pool,
        slots=len(pool) > 1,
        scope=scope,
        asks_registry=asks_registry,
        opens_transaction=opening is not None,
    )
    statement = _FIRST_TRY_TEXTS.get(shape)
    if statement is None:
        statement = _FIRST_TRY_TEXTS[shape] = _first_try_statement(shape).as_string(conn)
    if opening is None:
        row = conn.execute(statement, params).fetchone()
    else:
        # Several statements in one simple query take no parameters: psycopg binds them client-side.
        inlined = inline(conn, statement, params)
        cursor = conn.execute(sql.Composed([opening, sql.SQL(inlined)]))
        while cursor.nextset():  # the try's row is the last result
            pass
        row = cursor.fetchone()
    assert row is not None
    server = dataclasses.replace(handshake, backend_pid=row[1], in_recovery=row[2])
    taken, found = row[0], None
    if len(pool) > 1:
        if taken is not None:  # the position in the slots tried: the slot's number in the pool
            taken = tried[int(taken) - 1] + 1
        refusal = row[4 if asks_registry else 3]
        if refusal is not None:
            found = (str(refusal[0]), int(refusal[1]), int(refusal[2]))
    elif checks_pool and taken is not None:
        if taken in MARKER_BUSY:  # a pool of the name, or another plain user's momentary marker try
            taken = MARKER_BUSY[taken]
            if pool_in_use(conn, pool[0]):
                found, taken = ("pool", 0, 0), None
        else:
            taken = bool(taken)
    return FirstTry(
        taken=taken,
        server=server,
        registry=row[3] if asks_registry else None,
        xact_id=None if opening is None or row[-1] is None else int(row[-1]),
        conflict=found,
    )


def take(
    conn: psycopg.Connection[Any],
    handshake: ServerInfo,
    pool: Sequence[LockKey],
    *,
    shared: bool,
    scope: Scope,
    timeout: float | None,
    liveness: Liveness,
    pool_mode: str | None = None,
    candidates: Sequence[int] | None = None,
) -> HeldLock | None:
    """Take a key on a freshly opened lock session; None when busy (the caller closes ``conn``).

    The first statement tries the lock where it is safe and completes the server's facts
    (:func:`first_try`); the rules of :mod:`~airflow_pglock.server_rules` then judge them and raise
    :class:`~airflow_pglock.exceptions.UnsafeSetupError` for a set-up where a lock would
    exclude nobody (no lock was taken then). A wait (``timeout``) follows a refused try.

    :param handshake: what the handshake said (:func:`~airflow_pglock.server_rules.from_handshake`).
    :param pool: the key, or the slots of a pool, slot 1 first (:func:`~airflow_pglock.keys.slot_keys`,
        computed once by the caller); of a pool the lock held is the first free slot.
    :param scope: ``"session"`` (autocommit; held until released) or ``"transaction"``
        (a transaction is opened and stays open; the lock ends with it).
    :param timeout: None to try once, or seconds to wait (enforced by the server; a pool is polled).
    :param liveness: the lease's settings (a transaction lock sets them in its transaction).
    :param pool_mode: the connection's declared ``pool_mode``.
    :param candidates: a pool: the indexes of the slots that may be taken, in the order tried
        (default: all; a lock scope's task re-enters its own slot, and a guard passes over the
        slots that lock scopes hold between their tasks).
    """
    key, slots = pool[0], len(pool)
    if candidates is not None and (slots == 1 or not candidates or not set(candidates) <= set(range(slots))):
        raise LockConfigurationError(f"candidates must be slot indexes of a pool of {slots} slots, got {candidates!r}")
    opening = None
    if scope == "transaction":
        settings = liveness_statement(liveness, local=True, server_version_num=handshake.version_num)
        opening = sql.SQL(_OPEN_TRANSACTION).format(liveness=settings)
    answer = first_try(
        conn,
        handshake,
        list(pool),
        shared=shared,
        scope=scope,
        pool_mode=pool_mode,
        opening=opening,
        candidates=candidates,
    )
    server = answer.server
    found = server_rules.violations(server, scope, pool_mode)
    if not found and answer.conflict is not None:
        refusal = pool_conflict_error(conn, key, slots, answer.conflict)
        give_back_all(conn, scope)  # the markers it took before it looked
        raise refusal
    if found:
        if answer.taken and scope == "session":  # the statement's condition and the rules disagree
            unlock(conn, pool[int(answer.taken) - 1] if slots > 1 else key, shared=shared)
        raise found[0].error()
    if server.behind_pooler:
        # Through PgBouncer, a server-side prepared statement may outlive the transaction on a
        # server session another client gets next: never prepare on a lock connection.
        conn.prepare_threshold = None
    held_key = key
    if slots > 1:
        slot = None if answer.taken is None else int(answer.taken) - 1
        if slot is None and timeout is not None:
            tried = list(range(slots)) if candidates is None else list(candidates)
            with _cut_off_by_transaction_timeout(key, timeout, scope):
                position = wait_slot(conn, [pool[index] for index in tried], timeout, scope=scope)
            slot = None if position is None else tried[position]
        if slot is None:
            give_back_all(conn, scope)  # the pool's markers: the close alone frees them only once the backend exits
            return None
        held_key = pool[slot]
    elif not answer.taken:
        if timeout is None:
            return None
        with _cut_off_by_transaction_timeout(key, timeout, scope):
            if not wait_lock(conn, key, timeout, shared=shared, scope=scope):
                return None
            pooled = is_named_key(key) and pool_in_use(conn, key)  # a pool of the name began during the wait
        if pooled:
            refusal = pool_conflict_error(conn, key, 1, ("pool", 0, 0))
            give_back_all(conn, scope)  # the key it waited for
            raise refusal
    registry = answer.registry
    if not answer.taken and registry == SCOPES_IDLE:
        registry = SCOPES_LIVE  # the horizon was read before the wait: a scope may have begun since
    return HeldLock(
        key=held_key,
        shared=shared,
        scope=scope,
        connection=conn,
        server=server,
        xact_id=answer.xact_id,
        registry=registry,
        markers=pool_markers(key, slots) if scope == "session" else (),
        slot=pool.index(held_key) + 1 if slots > 1 else None,
    )


@contextlib.contextmanager
def _cut_off_by_transaction_timeout(key: LockKey, timeout: float, scope: Scope) -> Iterator[None]:
    """A transaction lock waits inside the transaction it is to be held in, which the server's
    ``transaction_timeout`` (PostgreSQL 17+) bounds, and ends with its session: a setting to fix,
    named, rather than the driver's bare error. (A session lock's wait lifts it for itself.)"""
    try:
        yield
    except psycopg.errors.TransactionTimeout as error:
        if scope != "transaction":
            raise
        raise LockConfigurationError(
            f"the wait for {key.describe()} was cut off by the server's transaction_timeout (PostgreSQL 17+), "
            f"before its own timeout of {timeout:g} s: a mode='transaction' lock waits inside the transaction it "
            "is held in, and the server ends the session when that transaction outlasts transaction_timeout. "
            "Wait less than transaction_timeout (wait_timeout), lift it for the lock's role or database "
            "(ALTER ROLE ... SET transaction_timeout = 0), or use mode='session', whose wait lifts it for itself"
        ) from error
