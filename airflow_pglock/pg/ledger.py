"""Completions and fencing tokens: what a lock alone cannot remember.

Hook-level module (SQL lives here). Tables come from migration 2 of
:mod:`airflow_pglock.pg.schema` (``airflow-pglock init-db``):

* ``pglock.completions``: one row per (key, period) that completed, with when (the
  database clock) and by which DAG run: ``once_per`` skips a period that is already done,
  ``min_interval`` skips while the key's last completion is too recent.
* ``pglock.fencing_tokens``: the last fencing token issued for each key. Tokens come from
  one sequence, so they only grow, also across keys and rolled-back transactions; the SQL
  helpers ``pglock.assert_fencing_token`` and the trigger function
  ``pglock.reject_stale_fencing_token`` let a protected table refuse a write that carries
  an older token than the one last issued for its key.

Every function runs while an *exclusive* lock on the key is held (shared locks are refused
with these rules), so checks and records are serialized by the lock itself. A completion is
recorded only by a statement that checks, in itself, that the lock is still held (and, in
transaction mode, that its transaction is still the one that took it); so is a fencing
token. In transaction mode a fencing token is issued on a side connection: it is visible to
every session at once, not only when the lock's transaction commits.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_pglock.display import printable
from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError, PgLockError
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.sql import execute_contained, held_condition, held_params

#: ``period`` of the rolling record kept for ``min_interval`` when no ``once_per`` is set.
ROLLING_PERIOD = ""

MIGRATION_STATEMENTS: tuple[str, ...] = (
    """
    CREATE TABLE pglock.completions (
        objsubid smallint NOT NULL CHECK (objsubid IN (1, 2)),
        classid bigint NOT NULL,
        objid bigint NOT NULL,
        key_name text,
        period text NOT NULL,
        completed_at timestamptz NOT NULL,
        dag_id text,
        task_id text,
        run_id text,
        map_index integer,
        fencing_token bigint,
        PRIMARY KEY (objsubid, classid, objid, period)
    )
    """,
    "CREATE INDEX completions_latest ON pglock.completions (objsubid, classid, objid, completed_at DESC)",
    "COMMENT ON TABLE pglock.completions IS 'airflow-pglock: completed (key, period) pairs for once_per and "
    "min_interval (period '''' = the rolling record of min_interval)'",
    "CREATE SEQUENCE pglock.fencing_token_seq",
    """
    CREATE TABLE pglock.fencing_tokens (
        objsubid smallint NOT NULL CHECK (objsubid IN (1, 2)),
        classid bigint NOT NULL,
        objid bigint NOT NULL,
        key_name text,
        token bigint NOT NULL,
        issued_at timestamptz NOT NULL,
        issued_to text,
        PRIMARY KEY (objsubid, classid, objid)
    )
    """,
    # The name -> int64 rule of keys.py.
    """
    CREATE FUNCTION pglock.name_key(name text) RETURNS bigint LANGUAGE sql IMMUTABLE STRICT AS
    $$ SELECT ('x' || left(encode(sha256(convert_to(name, 'UTF8')), 'hex'), 16))::bit(64)::bigint $$
    """,
    # Fencing helpers for int64 keys (explicit numbers) and named keys.
    """
    CREATE FUNCTION pglock.current_fencing_token(key bigint) RETURNS bigint LANGUAGE sql STABLE STRICT AS
    $$ SELECT token FROM pglock.fencing_tokens
       WHERE objsubid = 1 AND classid = (key >> 32) & 4294967295 AND objid = key & 4294967295 $$
    """,
    """
    CREATE FUNCTION pglock.current_fencing_token(name text) RETURNS bigint LANGUAGE sql STABLE STRICT AS
    $$ SELECT pglock.current_fencing_token(pglock.name_key(name)) $$
    """,
    """
    CREATE FUNCTION pglock.assert_fencing_token(key bigint, token bigint, label text DEFAULT NULL)
    RETURNS bigint LANGUAGE plpgsql STABLE AS
    $$
    DECLARE
        newest bigint := pglock.current_fencing_token(key);
        shown text := coalesce(quote_literal(label) || ' ', '') || '(int64 ' || key || ')';
    BEGIN
        IF token IS NULL THEN
            RAISE EXCEPTION 'no fencing token given for lock key %', shown USING ERRCODE = 'check_violation';
        END IF;
        IF newest IS NOT NULL AND token < newest THEN
            RAISE EXCEPTION 'stale fencing token % for lock key %: token % was issued since', token, shown, newest
                USING ERRCODE = 'check_violation',
                      HINT = 'the writer lost its lock and another holder took it; this write is refused';
        END IF;
        RETURN token;
    END
    $$
    """,
    """
    CREATE FUNCTION pglock.assert_fencing_token(name text, token bigint) RETURNS bigint LANGUAGE sql STABLE AS
    $$ SELECT pglock.assert_fencing_token(pglock.name_key(name), token, name) $$
    """,
    """
    CREATE FUNCTION pglock.reject_stale_fencing_token() RETURNS trigger LANGUAGE plpgsql AS
    $$
    BEGIN
        PERFORM pglock.assert_fencing_token(
            TG_ARGV[0], (to_jsonb(NEW) ->> coalesce(TG_ARGV[1], 'fencing_token'))::bigint);
        RETURN NEW;
    END
    $$
    """,
)

#: Migration 3: a token is valid only for a key that was issued one. Migration 2's
#: assert_fencing_token let any token pass for a key without tokens (a typo in the key name).
STRICT_FENCING_STATEMENTS: tuple[str, ...] = (
    """
    CREATE OR REPLACE FUNCTION pglock.assert_fencing_token(key bigint, token bigint, label text DEFAULT NULL)
    RETURNS bigint LANGUAGE plpgsql STABLE AS
    $$
    DECLARE
        newest bigint := pglock.current_fencing_token(key);
        shown text := coalesce(quote_literal(label) || ' ', '') || '(int64 ' || key || ')';
    BEGIN
        IF token IS NULL THEN
            RAISE EXCEPTION 'no fencing token given for lock key %', shown USING ERRCODE = 'check_violation';
        END IF;
        IF newest IS NULL THEN
            RAISE EXCEPTION 'no fencing token was ever issued for lock key %', shown
                USING ERRCODE = 'check_violation',
                      HINT = 'check the key name (a typo?) and that the task holding it runs with fencing=True';
        END IF;
        IF token < newest THEN
            RAISE EXCEPTION 'stale fencing token % for lock key %: token % was issued since', token, shown, newest
                USING ERRCODE = 'check_violation',
                      HINT = 'the writer lost its lock and another holder took it; this write is refused';
        END IF;
        RETURN token;
    END
    $$
    """,
)

#: A key's recorded token only grows, whoever writes the row: every task role may UPDATE the table
#: (the provider's own statement raises a row only), and a row set lower, or moved to another key,
#: would let a stale token pass the checks above.
TOKEN_NEVER_DOWN_STATEMENTS: tuple[str, ...] = (
    """
    CREATE OR REPLACE FUNCTION pglock.fencing_token_never_goes_down() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog AS
    $$
    BEGIN
        IF (NEW.objsubid, NEW.classid, NEW.objid) IS DISTINCT FROM (OLD.objsubid, OLD.classid, OLD.objid) THEN
            RAISE EXCEPTION 'the fencing token record of lock key % cannot move to another key',
                coalesce(quote_literal(OLD.key_name), '(' || OLD.classid || ', ' || OLD.objid || ')')
                USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.token IS NULL OR NEW.token < OLD.token THEN
            RAISE EXCEPTION 'the fencing token of lock key % cannot go down (% -> %)',
                coalesce(quote_literal(OLD.key_name), '(' || OLD.classid || ', ' || OLD.objid || ')'),
                OLD.token, NEW.token
                USING ERRCODE = 'check_violation',
                      HINT = 'a smaller token would let a writer that lost its lock pass the fencing checks';
        END IF;
        RETURN NEW;
    END
    $$
    """,
    "CREATE TRIGGER fencing_token_never_goes_down BEFORE UPDATE ON pglock.fencing_tokens"
    " FOR EACH ROW EXECUTE FUNCTION pglock.fencing_token_never_goes_down()",
)


@dataclass(frozen=True)
class Completion:
    """A recorded completion of a key (for one period, or the rolling record).

    :param completed_at: when it completed, on the database clock.
    :param age_seconds: how long ago, on the database clock.
    """

    period: str
    completed_at: dt.datetime
    age_seconds: float
    dag_id: str | None
    task_id: str | None
    run_id: str | None
    map_index: int | None
    fencing_token: int | None

    def describe(self) -> str:
        who = f"{self.dag_id}/{self.task_id}" if self.dag_id else "an unknown task"
        if self.map_index is not None and self.map_index >= 0:
            who += f"[{self.map_index}]"
        run = f" run {self.run_id}" if self.run_id else ""
        at = self.completed_at.isoformat(timespec="seconds")
        return f"at {at} ({self.age_seconds:.0f} s ago) by {printable(who + run)}"  # the row's texts are anyone's


def _missing_tables(feature: str) -> LockConfigurationError:
    return LockConfigurationError(
        f"{feature} needs airflow-pglock's tables (schema 'pglock', version 2 or newer), which are missing in this "
        "database: run `airflow-pglock init-db --conn-id <your lock connection>` once (see docs/once-per-period.md)"
    )


def _coordinates(key: LockKey) -> dict[str, Any]:
    classid, objid, objsubid = key.pg_locks
    return {"objsubid": objsubid, "classid": classid, "objid": objid}


_COMPLETION_COLUMNS = (
    "period, completed_at, extract(epoch FROM pg_catalog.clock_timestamp() - completed_at)::float8,"
    " dag_id, task_id, run_id, map_index, fencing_token"
)


def _completion(row: Any) -> Completion:
    return Completion(*row)  # _COMPLETION_COLUMNS are the record's fields, in order


def _run(conn: psycopg.Connection[Any], feature: str, statement: str, params: dict[str, Any]) -> Any:
    """Run one statement; a missing table becomes the init-db message (in a savepoint when in a transaction)."""
    try:
        return execute_contained(conn, statement, params, "pglock_ledger")
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName, psycopg.errors.UndefinedFunction):
        raise _missing_tables(feature) from None


# The check before the work also asks whether this role may make the record after it (an upsert:
# INSERT of its columns, UPDATE of those it overwrites; a table grant or column grants), so a role
# without them fails before the work, not after each try's work. Row-level security and triggers
# on the table are not looked at.
_UPDATED = ("completed_at", "key_name", "dag_id", "task_id", "run_id", "map_index", "fencing_token")
_INSERTED = ("objsubid", "classid", "objid", "period", *_UPDATED)
_MAY_RECORD = " AND ".join(
    [f"pg_catalog.has_column_privilege('pglock.completions', '{column}', 'INSERT')" for column in _INSERTED]
    + [f"pg_catalog.has_column_privilege('pglock.completions', '{column}', 'UPDATE')" for column in _UPDATED]
)


#: Read-only by default (``default_transaction_read_only``, a role's or a database's): the record
#: would fail after the work as surely as a missing grant.
_READ_ONLY = "pg_catalog.current_setting('transaction_read_only') = 'on'"


def _found_if_recordable(feature: str, row: Any) -> Completion | None:
    may_record, read_only, *found = row
    if read_only:
        raise LockConfigurationError(
            f"{feature}: this session's transactions are read-only (default_transaction_read_only = on, for the "
            "role or the database), so the run would do its work and then fail to record it (each retry doing the "
            "work again): set default_transaction_read_only = off for the lock's role (ALTER ROLE ... SET "
            "default_transaction_read_only = off), or remove it from the database"
        )
    if not may_record:
        raise LockConfigurationError(
            f"{feature}: this role may read pglock.completions but not INSERT and UPDATE it, so the run would do "
            "its work and then fail to record it (each retry doing the work again): run "
            "`airflow-pglock init-db --grant <this role>` (see docs/once-per-period.md)"
        )
    return _completion(found) if found[0] is not None else None  # period is NOT NULL: None when none


def completion_for_period(conn: psycopg.Connection[Any], key: LockKey, period: str) -> Completion | None:
    """The completion recorded for ``key`` and ``period``, if any.

    :raises LockConfigurationError: this role may not record a completion (before the work).
    """
    cursor = _run(
        conn,
        "once_per",
        f"SELECT {_MAY_RECORD}, {_READ_ONLY}, found.* FROM (SELECT 1) AS one LEFT JOIN LATERAL"
        f" (SELECT {_COMPLETION_COLUMNS} FROM pglock.completions WHERE objsubid = %(objsubid)s"
        " AND classid = %(classid)s AND objid = %(objid)s AND period = %(period)s) AS found ON true",
        {**_coordinates(key), "period": period},
    )
    return _found_if_recordable("once_per", cursor.fetchone())


def last_completion(conn: psycopg.Connection[Any], key: LockKey) -> Completion | None:
    """The most recent completion of ``key`` in any period.

    :raises LockConfigurationError: this role may not record a completion (before the work).
    """
    cursor = _run(
        conn,
        "min_interval",
        f"SELECT {_MAY_RECORD}, {_READ_ONLY}, found.* FROM (SELECT 1) AS one LEFT JOIN LATERAL"
        f" (SELECT {_COMPLETION_COLUMNS} FROM pglock.completions WHERE objsubid = %(objsubid)s"
        " AND classid = %(classid)s AND objid = %(objid)s ORDER BY completed_at DESC LIMIT 1) AS found ON true",
        _coordinates(key),
    )
    return _found_if_recordable("min_interval", cursor.fetchone())


def record_completion(
    conn: psycopg.Connection[Any],
    key: LockKey,
    period: str,
    identity: TaskIdentity | None,
    fencing_token: int | None,
    *,
    shared: bool = False,
    xact_id: int | None = None,
) -> bool:
    """Record that ``key`` completed ``period`` now (database clock), if the lock is still held.

    The statement itself checks that this session holds the key (in transaction ``xact_id``,
    for a transaction lock): no completion is ever recorded without the lock. In
    transaction mode it runs inside the lock's transaction: it commits with the author's
    writes or not at all.

    :returns: False (nothing recorded) when the lock was not held any more.
    """
    condition = held_condition(
        None, ("%(classid)s", "%(objid)s", "%(objsubid)s", "%(lock_mode)s"), None if xact_id is None else "%(xact_id)s"
    )
    lock_mode = held_params(key, shared)[3]
    cursor = _run(
        conn,
        "once_per / min_interval",
        "INSERT INTO pglock.completions (objsubid, classid, objid, key_name, period, completed_at,"
        " dag_id, task_id, run_id, map_index, fencing_token)"
        " SELECT %(objsubid)s, %(classid)s, %(objid)s, %(name)s, %(period)s, pg_catalog.clock_timestamp(),"
        " %(dag_id)s, %(task_id)s, %(run_id)s, %(map_index)s, %(token)s"
        f" WHERE {condition}"
        " ON CONFLICT (objsubid, classid, objid, period) DO UPDATE SET completed_at = excluded.completed_at,"
        " key_name = excluded.key_name, dag_id = excluded.dag_id, task_id = excluded.task_id,"
        " run_id = excluded.run_id, map_index = excluded.map_index, fencing_token = excluded.fencing_token",
        {
            **_coordinates(key),
            "lock_mode": lock_mode,
            "xact_id": xact_id,
            "name": key.name,
            "period": period,
            "dag_id": identity.dag_id if identity else None,
            "task_id": identity.task_id if identity else None,
            "run_id": identity.run_id if identity else None,
            "map_index": identity.map_index if identity else None,
            "token": fencing_token,
        },
    )
    return bool(cursor.rowcount == 1)


def issue_fencing_token(
    conn: psycopg.Connection[Any],
    key: LockKey,
    issued_to: str | None,
    *,
    holder_pid: int | None = None,
    shared: bool = False,
    xact_id: int | None = None,
) -> int | None:
    """Issue the next fencing token for ``key`` (larger than every token issued before), if the
    lock is still held; None, recording nothing, when it is not.

    ``conn`` is the lock's own connection (``holder_pid`` None) or a side connection next to
    the lock session ``holder_pid`` (transaction mode: the token is committed at once, so every
    session refuses the previous holder's token from now on).
    The number is drawn first; the statement that records it then checks, in itself, that
    the lock's session holds the key (in the transaction that took it). A recorded token
    was therefore drawn while the lock was held without a break, before any later holder
    could draw its own; a holder that lost the key before its token (a stall past the
    lease) records none, and the next holder's token stays the newest. A number drawn but
    not recorded is never used.
    """
    condition = held_condition(
        "%(holder_pid)s" if holder_pid is not None else None,
        ("%(classid)s", "%(objid)s", "%(objsubid)s", "%(lock_mode)s"),
        "%(xact_id)s" if xact_id is not None else None,
    )
    # Drawn by a statement of its own, before the check: in one statement PostgreSQL may test a
    # condition that reads no table row before it evaluates the row (a later holder could draw
    # in between). Passed on as a value, not currval(): behind a transaction pooler the next
    # statement may run on another server session.
    # The draw commits without waiting for a synchronous standby (nextval writes to the WAL now and
    # then, and that commit would wait with no bound): the record's commit below comes later in the
    # WAL, so the standby that confirms it has the draw too.
    draw = (
        "SELECT pg_catalog.nextval('pglock.fencing_token_seq'),"
        " pg_catalog.set_config('synchronous_commit', 'local', true)"
    )
    try:
        drawn = _run(conn, "fencing", draw, {}).fetchone()
    except psycopg.errors.SequenceGeneratorLimitExceeded:
        raise _used_up(conn, key) from None
    assert drawn is not None
    warnings: list[str] = []

    def heard(notice: psycopg.errors.Diagnostic) -> None:
        if notice.severity_nonlocalized == "WARNING":
            warnings.append(f"{notice.message_primary} {notice.message_detail or ''}".strip())

    # statement_timeout does not end a commit's wait for the synchronous standby, and the key is
    # held meanwhile: the wait is bounded here, by a cancel (which commits locally and warns).
    bound = _CommitBound(conn, TOKEN_COMMIT_WAIT_SECONDS)
    conn.add_notice_handler(heard)
    try:
        with bound:
            row = _record_token(conn, key, condition, drawn[0], shared, holder_pid, xact_id, issued_to)
    except psycopg.errors.QueryCanceled:
        if not bound.fired:
            raise
        row = None
    finally:
        conn.remove_notice_handler(heard)
    if bound.fired:
        raise LockConnectionError(
            f"the fencing token of {key.describe()} was not recorded and committed within "
            f"{TOKEN_COMMIT_WAIT_SECONDS:g} s (a synchronous standby that does not answer?): not handed to the work"
        )
    if row is not None and warnings:
        # A wait for the synchronous standby that was cancelled (pg_cancel_backend) commits locally
        # and says so in a WARNING only: the standby may not have the token, and a failover to it
        # would issue the same number again.
        raise LockConnectionError(
            f"the fencing token {row} of {key.describe()} was committed on the primary, but the commit "
            f"warned: {'; '.join(warnings)}. A synchronous standby may not have it (after a failover the "
            "same token could be issued again): not handed to the work"
        )
    if row is None:
        _refuse_a_sequence_out_of_order(conn, key, drawn[0])
    return row


#: Moves the sequence past every recorded token below its maximum: a setval to the maximum itself
#: would leave no number for any key.
_SETVAL = (
    "SELECT pg_catalog.setval('pglock.fencing_token_seq', (SELECT pg_catalog.max(token) FROM"
    " pglock.fencing_tokens WHERE token < {maximum}))"
)


def _refuse_a_sequence_out_of_order(conn: psycopg.Connection[Any], key: LockKey, drawn: int) -> None:
    """A token not recorded because the key's newest token is ahead of the sequence (the key's row set
    ahead by hand, the sequence set back, or restored without the table) or because the sequence hands
    numbers out of order (``CACHE`` > 1: each session draws from a range of its own) fails the run with
    what to run, not as lost: every later try would fail the same way. A row at the sequence's maximum
    is mended by deleting it only (a setval to it would leave no number for any key).

    A holder that lost the key to a later one that drew after it is told apart: that one's token is
    at most the sequence's last value (the sequence hands numbers out once), a token set by hand past
    it is not. A last value the server does not say (``is_called`` false: restarted just now) proves
    nothing, nor does a look that fails (the session ended meanwhile): the run is reported lost, as before.
    """
    try:
        found = _run(
            conn,
            "fencing",
            "SELECT tokens.token, pg_catalog.pg_sequence_last_value(seq.seqrelid), seq.seqcache, seq.seqmax"
            " FROM pg_catalog.pg_sequence AS seq"
            " LEFT JOIN pglock.fencing_tokens AS tokens ON tokens.objsubid = %(objsubid)s"
            " AND tokens.classid = %(classid)s AND tokens.objid = %(objid)s"
            " WHERE seq.seqrelid = 'pglock.fencing_token_seq'::regclass",
            _coordinates(key),
        ).fetchone()
    except (psycopg.Error, PgLockError):
        return
    if found is None or found[0] is None or found[0] <= drawn:
        return
    newest, last, cache, maximum = found
    if cache > 1:
        raise LockConfigurationError(
            f"the newest fencing token of {key.describe()} is {newest} and this run drew {drawn}: the sequence "
            f"pglock.fencing_token_seq has CACHE {cache}, so each session draws from a range of its own and "
            "tokens do not follow the order of the holds. Run, as the schema's owner: ALTER SEQUENCE "
            f"pglock.fencing_token_seq CACHE 1; then {_SETVAL.format(maximum=maximum)} (a row at the sequence's "
            "maximum, any key's, is mended by deleting it, if no holder was ever given it). The work did not run"
        )
    if last is not None and newest > last:
        raise LockConfigurationError(
            f"the newest fencing token of {key.describe()} in pglock.fencing_tokens is {newest}, ahead of the "
            f"sequence pglock.fencing_token_seq (last value {last}; this run drew {drawn}): the key's row was set "
            "ahead by hand (an UPDATE of pglock.fencing_tokens), or the sequence was set back (setval, ALTER "
            "SEQUENCE ... RESTART, or restored without the table), so no token can be issued for this key until "
            f"the sequence is past the row. The work did not run. {_ahead_remedy(key, newest, maximum)}"
        )


def _used_up(conn: psycopg.Connection[Any], key: LockKey) -> LockConfigurationError:
    """The sequence at its maximum (set there by hand): no key can draw a token until it is set back."""
    try:
        found = _run(
            conn,
            "fencing",
            "SELECT seq.seqmax, (SELECT pg_catalog.max(token) FROM pglock.fencing_tokens WHERE token < seq.seqmax)"
            " FROM pg_catalog.pg_sequence AS seq WHERE seq.seqrelid = 'pglock.fencing_token_seq'::regclass",
            {},
        ).fetchone()
    except (psycopg.Error, PgLockError):
        found = None
    maximum = "its maximum" if found is None else f"its maximum ({found[0]})"
    if found is None:
        remedy = "set it back past every recorded token below its maximum"
    elif found[1] is None:  # no recorded token below the maximum: nothing to stay ahead of
        remedy = "ALTER SEQUENCE pglock.fencing_token_seq RESTART"
    else:
        remedy = _SETVAL.format(maximum=found[0])
    return LockConfigurationError(
        f"no fencing token can be issued for {key.describe()}: the sequence pglock.fencing_token_seq reached "
        f"{maximum} (a setval to it, or ALTER SEQUENCE ... RESTART/MAXVALUE, by hand), so every fenced run of "
        f"every key fails. The work did not run. As the schema's owner: {remedy} (a row of "
        "pglock.fencing_tokens at the maximum, any key's, is mended by deleting it, if no holder was ever given it)"
    )


def _ahead_remedy(key: LockKey, newest: int, maximum: int) -> str:
    """What the schema's owner runs when ``key``'s row is ahead of the sequence (whose maximum is ``maximum``)."""
    where = " AND ".join(f"{column} = {value}" for column, value in _coordinates(key).items())
    delete = f"DELETE FROM pglock.fencing_tokens WHERE {where};"
    if newest >= maximum:
        return (
            f"No token can follow {newest}: it is at the sequence's maximum ({maximum}), and a setval to it "
            "would leave no number for any key. As the schema's owner, if no holder was ever given it (a row "
            f"set by hand), delete the row (the next run records the sequence's next token): {delete}"
        )
    return (
        "As the schema's owner: if tokens up to it were issued (the sequence was set back), move the sequence "
        "past every recorded token below its maximum (a row at the maximum, any key's, is mended by its own "
        f"DELETE): {_SETVAL.format(maximum=maximum)}. If the row was set ahead by hand and no holder was ever "
        f"given {newest}, delete it instead (the next run records the sequence's next token): {delete}"
    )


#: The longest a fencing token's commit waits for the synchronous standby before the run fails
#: (neither statement_timeout nor the lease ends that wait, and the key is held during it).
TOKEN_COMMIT_WAIT_SECONDS = 30.0
#: How long the bound's cancel request may take to reach the server (it then gives up: the statement
#: goes on, and its answer is void all the same).
CANCEL_TIMEOUT_SECONDS = 5.0


class _CommitBound:
    """Cancels the statement on ``conn`` once ``seconds`` have passed (from a timer thread). A
    cancel that fired makes the statement's outcome void, whatever it was: it may have crossed
    the statement's end and land on the next one, which only the failure path then sends."""

    def __init__(self, conn: psycopg.Connection[Any], seconds: float) -> None:
        self._conn = conn
        self._seconds = seconds
        self._mutex = threading.Lock()
        self._done = False
        self.fired = False
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        with self._mutex:
            if self._done:
                return
            self.fired = True
            with contextlib.suppress(Exception):  # the connection broke meanwhile: the statement fails
                self._conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)

    def __enter__(self) -> None:
        self._timer = threading.Timer(self._seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def __exit__(self, *exc: object) -> None:
        with self._mutex:
            self._done = True
        assert self._timer is not None
        self._timer.cancel()


def _record_token(
    conn: psycopg.Connection[Any],
    key: LockKey,
    condition: str,
    token: int,
    shared: bool,
    holder_pid: int | None,
    xact_id: int | None,
    issued_to: str | None,
) -> int | None:
    # synchronous_commit is on for this statement's commit whatever the role or the database sets
    # (local, off): the token must reach a synchronous standby before the work gets it; and the
    # commit's WARNING when that wait was cancelled reaches the client whatever client_min_messages
    # it sets (error would hide it).
    cursor = _run(
        conn,
        "fencing",
        "INSERT INTO pglock.fencing_tokens (objsubid, classid, objid, key_name, token, issued_at, issued_to)"
        " SELECT %(objsubid)s, %(classid)s, %(objid)s, %(name)s, %(token)s, pg_catalog.clock_timestamp(), %(issued_to)s"
        " FROM (SELECT pg_catalog.set_config('synchronous_commit', 'on', true),"
        " pg_catalog.set_config('client_min_messages', 'warning', true)) AS durable"
        f" WHERE {condition}"
        " ON CONFLICT (objsubid, classid, objid) DO UPDATE SET token = excluded.token,"
        " key_name = excluded.key_name, issued_at = excluded.issued_at, issued_to = excluded.issued_to"
        " WHERE fencing_tokens.token < excluded.token"
        " RETURNING token",
        {
            **_coordinates(key),
            "lock_mode": held_params(key, shared)[3],
            "holder_pid": holder_pid,
            "xact_id": xact_id,
            "name": key.name,
            "token": token,
            "issued_to": issued_to,
        },
    )
    row = cursor.fetchone()
    return int(row[0]) if row else None


@dataclass(frozen=True)
class FencingReplication:
    """Whether fencing tokens are in use, and what would keep them after a failover.

    :param synchronous_standby_names: the server's setting ('' when replication is asynchronous).
    :param synchronous_standbys: standbys connected as ``sync`` or ``quorum`` now (0 also when this
        role may not read ``pg_stat_replication``'s states).
    """

    synchronous_standby_names: str
    synchronous_standbys: int


def fencing_replication(conn: psycopg.Connection[Any]) -> FencingReplication | None:
    """What replication protects the fencing tokens; None when no token was ever issued (or the
    ledger is not installed, or this role may not read it)."""
    try:
        row = conn.execute("SELECT pg_catalog.to_regclass('pglock.fencing_tokens') IS NOT NULL").fetchone()
        if not row or not row[0]:
            return None
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pglock.fencing_tokens),"
            " pg_catalog.current_setting('synchronous_standby_names'),"
            " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_replication WHERE sync_state IN ('sync', 'quorum'))"
        ).fetchone()
    except psycopg.errors.InsufficientPrivilege:  # a role without USAGE on the schema: not its business
        return None
    if not row or not row[0]:
        return None
    return FencingReplication(synchronous_standby_names=row[1] or "", synchronous_standbys=int(row[2]))
